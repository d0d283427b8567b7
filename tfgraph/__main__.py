import sys

from tfgraph.cli import main

sys.exit(main())
