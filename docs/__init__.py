"""tpdp-verify's documentation, shipped in the wheel as ``tpdp_verify.docs``: ``tpdp-verify docs``
lists its pages, ``tpdp-verify docs PAGE`` prints one."""
