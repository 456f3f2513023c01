from visiontrain.app.cli import main

raise SystemExit(main())
