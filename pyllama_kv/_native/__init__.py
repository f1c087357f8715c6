"""The C side: declarations (decl/*.h), loading the library (ffi.py) and finding it (locate.py)."""
