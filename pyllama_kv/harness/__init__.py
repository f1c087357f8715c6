"""Vendor, patch and build llama.cpp: used by the CLI's harness commands and the tests, never imported
by the runtime API."""
