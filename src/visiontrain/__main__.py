from visiontrain.cli import main

raise SystemExit(main())
