import sys

from shoal.node.daemon import main

sys.exit(main())
