import sys

from tpdp_verify.cli import main

if __name__ == "__main__":
    sys.exit(main())
