from shoal.e2b.server import main

raise SystemExit(main())
