"""Command implementations over `weights/` and `models/`: make-tiny, convert, verify."""
