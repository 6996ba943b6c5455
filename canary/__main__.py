from .replay.cli import main

raise SystemExit(main())
