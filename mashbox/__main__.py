from mashbox.cli import main

raise SystemExit(main())
