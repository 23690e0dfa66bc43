from smelt_model.budget.cli import main

raise SystemExit(main())
