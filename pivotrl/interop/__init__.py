"""Exchange formats with other RL frameworks (``nemo``: NeMo Gym / NeMo RL PivotRL rows)."""
