from h3direct.cli import main

raise SystemExit(main())
