"""Fault injection for tests/test_faults.py: imported at start-up by every Python process that has this
directory on ``PYTHONPATH`` (so also by a stage that ``dvc repro`` starts).

``GRPO_FAULT="<script>|<point>"`` SIGKILLs the process whose ``sys.argv[0]`` ends with ``<script>``
(never DVC itself, nor spawned workers) at ``<point>``:

* ``replace:<substring>:before`` / ``replace:<substring>:after`` -- just before / just after the
  ``os.replace`` (the atomic rename of every output) whose destination contains ``<substring>``;
* ``timer:<seconds>`` -- that many seconds after start-up, wherever the stage is then.
"""

import os
import signal
import sys
import threading

_SPEC = os.environ.get("GRPO_FAULT", "")


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _install(point: str) -> None:
    kind, _, arg = point.partition(":")
    if kind == "timer":
        t = threading.Timer(float(arg), _die)
        t.daemon = True
        t.start()
    elif kind == "replace":
        sub, when = arg.rsplit(":", 1)
        real = os.replace

        def replace(src, dst, *a, **k):
            hit = sub in os.fspath(dst)
            if hit and when == "before":
                _die()
            real(src, dst, *a, **k)
            if hit and when == "after":
                _die()

        os.replace = replace
    else:
        raise ValueError(f"GRPO_FAULT: unknown point {point!r}")


if _SPEC:
    _script, _point = _SPEC.split("|", 1)
    if sys.argv and sys.argv[0].endswith(_script):
        _install(_point)
