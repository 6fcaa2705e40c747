from h3direct.app.cli import main

raise SystemExit(main())
