"""Setuptools entry point; all metadata lives in setup.cfg."""
import setuptools

setuptools.setup()
