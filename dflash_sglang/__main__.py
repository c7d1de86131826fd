from dflash_sglang.cli import main

raise SystemExit(main())
