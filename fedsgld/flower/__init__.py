"""The Flower transport: the message protocol, the server's round loop (runner and
strategy) and the site handlers. Importing it imports Flower."""
