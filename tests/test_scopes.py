"""How `make test` (pytest-xdist, --dist loadscope) splits the suite into scopes (tests/conftest.py):
the multi-rank tests one after another on one worker, and every test of the real Prefect server
on one worker, so that the session's server starts once."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import LONGEST_FIRST, marked_tests

TESTS = Path(__file__).resolve().parent
REAL_SERVER_FIXTURES = {"prefect_server", "served", "server_api"}


def _test_functions(path: Path):
    return [node for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def test_every_test_of_the_real_server_is_in_one_scope():
    users = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in _test_functions(path):
            if REAL_SERVER_FIXTURES & {a.arg for a in node.args.args}:
                users[f"{path.relative_to(TESTS)}::{node.name}"] = marked_tests(path).get(node.name)
    assert {name.split("::")[0] for name in users} >= {"test_alerts.py", "test_served.py"}, users
    assert set(users.values()) == {"prefect-server"}, users


def test_multi_rank_wins_and_unmarked_tests_keep_their_file(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("import pytest\n\n@pytest.mark.server\n@pytest.mark.multi_rank\ndef test_both(): pass\n\n"
                    "@pytest.mark.server\ndef test_server(): pass\n\ndef test_plain(): pass\n")
    assert marked_tests(path) == {"test_both": "multi-rank", "test_server": "prefect-server"}
    assert LONGEST_FIRST[:2] == ("multi-rank", "prefect-server")


def test_every_longest_first_name_is_a_scope_of_the_suite():
    """The scheduler moves a LONGEST_FIRST scope to the front only while one of that name is
    queued: a file renamed or moved, or one whose every test became marked, would silently leave
    its long scope to the end again."""
    from tests.conftest import MARKED_SCOPES

    for scope in LONGEST_FIRST:
        if scope in MARKED_SCOPES.values():
            continue
        path = TESTS.parent / scope
        assert path.is_file(), f"LONGEST_FIRST names {scope}, which is not a test file"
        unmarked = [node.name for node in _test_functions(path) if node.name not in marked_tests(path)]
        assert unmarked, f"LONGEST_FIRST names {scope}, whose tests all run in a marked scope"
