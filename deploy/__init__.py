"""The Ray Serve application (``deploy.app:build_app``): engine and router deployments
and the capacity-aware routing of D's calls. Imports Ray (the ``serve`` extra), so it is
imported by its modules, not here."""

__all__: list[str] = []
