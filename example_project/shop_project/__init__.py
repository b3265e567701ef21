# Load the Celery app with Django, so @app.task and the checks find it.
from shop_project.celery import app as celery_app

__all__ = ["celery_app"]
