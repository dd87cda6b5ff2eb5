import sys

from jointspec.cli.main import main

sys.exit(main())
