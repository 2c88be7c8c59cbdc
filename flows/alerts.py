"""A failed night reaches a person: a server automation, created with the deployments
(deployments/serve.py), that posts a Slack-compatible message (``{"text": ...}``) to a webhook when
a run of those deployments fails or crashes.

The message names the run (and its deployment), its state, the iteration it reached and the last
line of its error (the flow run's labels ``dmd2_iteration`` / ``dmd2_error``, flows/runs.py; the
state's message when the run died without saying), and the link to the run. The webhook URL lives
in the block's secrets (a Slack incoming-webhook URL is a credential), the block is
``custom-webhook/dmd2-failures``; a crash is followed by a rerun (the rerun automation), so a
crash message says so.
"""

from __future__ import annotations

from typing import Optional

ALERT_AUTOMATION = "dmd2: tell a person when a run fails"
WEBHOOK_BLOCK = "dmd2-failures"
WEBHOOK_ENV = "DMD2_ALERT_WEBHOOK_URL"

SUBJECT = "dmd2 {{ flow_run.state.name }}: {{ flow_run.name }}"
BODY = (
    "dmd2 run {{ flow_run.name }}{% if deployment %} (deployment {{ deployment.name }}){% endif %} "
    "is {{ flow_run.state.name }}"
    "{% if flow_run.labels.dmd2_iteration is defined %} at iteration {{ flow_run.labels.dmd2_iteration }}{% endif %}.\n"
    "Last error: {{ flow_run.labels.dmd2_error if flow_run.labels.dmd2_error is defined else flow_run.state.message }}\n"
    "{% if flow_run.state.type.value == 'CRASHED' %}It will be rerun from its checkpoint "
    "(max_crash_reruns bounds the reruns).\n{% endif %}"
    "{{ flow_run|ui_url or ('flow run ' ~ flow_run.id) }}"
)


def webhook_block(url: str):
    """The notification block: POST {"text": subject + body} to ``url`` (kept as a secret)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    return CustomWebhookNotificationBlock(name="dmd2 failures", url="{{webhook_url}}", method="POST",
                                          json_data={"text": "{{subject}}\n{{body}}"},
                                          secrets={"webhook_url": url})


def ensure_failure_alert(deployment_ids: list, webhook_url: Optional[str]) -> Optional[str]:
    """The block and the automation (both replaced if they exist); without a URL, none (and an
    older automation of this name is removed). Returns the automation's id."""
    from datetime import timedelta

    from prefect.automations import Automation, EventTrigger, Posture, SendNotification
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(ALERT_AUTOMATION):
            client.delete_automation(old.id)
    if not webhook_url:
        return None
    block_id = webhook_block(webhook_url).save(WEBHOOK_BLOCK, overwrite=True)
    related = {"prefect.resource.role": "deployment",
               "prefect.resource.id": [f"prefect.deployment.{d}" for d in deployment_ids]}
    automation = Automation(
        name=ALERT_AUTOMATION,
        description="A dmd2 deployment run that fails or crashes posts a message to the dmd2-failures webhook.",
        trigger=EventTrigger(expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                             match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=related,
                             posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    )
    return str(automation.create().id)
