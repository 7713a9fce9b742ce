from sm120fork.cli import main

raise SystemExit(main())
