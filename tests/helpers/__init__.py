"""What several test modules share (a test module never imports another): tests/ is on sys.path under
pytest (its conftest.py), so test modules import these as `helpers.<module>`."""
