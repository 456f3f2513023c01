"""``visiontrain tune``: the study (``study``), its search space (``space``), one trial as a
``visiontrain fit`` subprocess (``trial``) and what a search writes (``outputs``)."""
