"""An experiment beside kvscope's tracer: a load's record made in C (`record.c`), to size what recording
outside Python would save on the planning thread (issue 3). Not used by the connector."""
