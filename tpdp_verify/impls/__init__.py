"""The implementations under test: torch's, the reference transform and FSDP extension
written from their contracts, or a user's, chosen by name (``select``)."""
