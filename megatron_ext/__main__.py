from megatron_ext.cli import main

raise SystemExit(main())
