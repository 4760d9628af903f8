"""Receiving and verifying bytes: a Fetch stream read without protobuf's copies, each
tensor allocated once at its final shape and every slice checked against its digest.
"""
