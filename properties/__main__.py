"""``python -m tpdp_verify.properties``: find the suite's cover cases again and ship them
(properties/cover_cases.json), after a change of a case strategy or of hypothesis."""

import json

import hypothesis

from tpdp_verify.properties import ALL
from tpdp_verify.properties.training import FOUND, find_cover_cases

if __name__ == "__main__":
    FOUND.write_text(json.dumps({"hypothesis": hypothesis.__version__, "cases": find_cover_cases(ALL)}, indent=1)
                     + "\n")
    print(f"wrote {FOUND}")
