"""Test plumbing shared by the test directories (imported as ``helpers.<module>``)."""
