from tests.chaos.report import main

raise SystemExit(main())
