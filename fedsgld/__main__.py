from fedsgld.cli.commands import main

raise SystemExit(main())
