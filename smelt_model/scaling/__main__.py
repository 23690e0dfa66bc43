from smelt_model.scaling.report import main

raise SystemExit(main())
