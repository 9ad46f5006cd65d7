"""The package version, in a module of its own at the bottom of the layers: every layer may
read it without importing the package root, whose public API sits at the top."""

__version__ = "0.1.0"
