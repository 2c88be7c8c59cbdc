raise RuntimeError("hook module broken at import time")
