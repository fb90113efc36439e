"""Tenancy: authentication, quotas, concurrency caps and usage records."""
