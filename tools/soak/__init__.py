"""``kvhandoff soak``: minutes of mixed load on P, D and the router as processes
(``run``), the load itself (``load``), and the verdict over the minutes (``verdict``)."""
