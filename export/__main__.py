"""``python -m export`` in the checkout: runs ``dspark_export`` (installed, also ``dspark-export``)."""

import sys

from dspark_export.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
