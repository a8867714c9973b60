"""Lab helpers for notebooks: drawings, monitors, widgets, exercise checks."""
