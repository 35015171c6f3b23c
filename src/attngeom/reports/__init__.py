"""Presentation: figures and tables, kept apart from the math and the capture."""
