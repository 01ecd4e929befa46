"""Bridges to other libraries; each module imports its library lazily (optional dependencies)."""
