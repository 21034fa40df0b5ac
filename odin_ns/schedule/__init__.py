"""Ahead-of-time plans: which views run where and when. A Schedule is plain data."""
