import os
import sys

from .replay import ranks
from .replay.cli import main

status = main()
if ranks.is_worker():
    # A rank process (--ranks) ends here without the interpreter's teardown: gloo's threads, still alive while
    # C++ statics are destroyed, can abort an exit that had finished its work (status 134 would fail the replay).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(status or 0))
raise SystemExit(status)
