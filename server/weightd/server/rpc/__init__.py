"""The gRPC edge: servicers, interceptors, guards, the Fetch wire encoding and resume.

Thin: each handler validates the request, calls the domain stages and maps a typed error
to a status through the one table. Never imports :mod:`weightd.server.transports`.
"""
