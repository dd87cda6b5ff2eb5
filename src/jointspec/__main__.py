import sys

from jointspec.cli import main

sys.exit(main())
