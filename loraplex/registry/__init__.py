"""Adapter registry: tenants, API keys, versioned adapters, hot-swap and audit, in SQL.

Entry points: ``db.upgrade(url)`` then ``service.RegistryService.from_url(url)``.
"""
