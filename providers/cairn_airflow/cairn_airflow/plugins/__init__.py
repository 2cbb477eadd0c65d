"""cairn's Airflow UI: the snapshots page (a FastAPI app with an external view), its JSON API
and the "cairn snapshots" extra link. :class:`~cairn_airflow.plugins.plugin.CairnPlugin` is
the ``airflow.plugins`` entry point."""
