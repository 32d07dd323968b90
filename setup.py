"""Shim only: all metadata lives in pyproject.toml. It exists because the design
card asks for a setup.py (older tools and some site install scripts look for it)."""
from setuptools import setup

setup()
