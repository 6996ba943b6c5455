from .replay import ranks
from .replay.cli import main

status = main()
if ranks.is_worker():  # a rank of --ranks: canary.replay.ranks.end says why
    ranks.end(status)
raise SystemExit(status)
