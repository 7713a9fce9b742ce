# MUSA (Moore Threads GPU) hardware backend
