"""Deployment: the Serve application builder (`deploy.app:build_app`), its config schema
(ServeAppConfig), `ray up` cluster configs (deploy/clusters/) and their validator."""

__all__ = ["app", "schema"]
