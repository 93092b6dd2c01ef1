"""What operators and tenants read about the server: usage, audit, the AdminClient routes and the dashboard."""
