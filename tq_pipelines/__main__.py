import sys

from tq_pipelines.cli import main

sys.exit(main())
